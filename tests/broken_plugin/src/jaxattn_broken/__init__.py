"""Test fixture: a jaxattn plugin whose registration module cannot be imported."""
