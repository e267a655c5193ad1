raise ImportError("this plugin needs libmissing.so")
