"""Selection: which provider runs a call, and why (auto, explain, records and priors)."""
