"""A plugin whose import fails, as when its compiled extension is missing."""

raise ImportError("libfixture.so: cannot open shared object file")
