"""Built-in SCM files (package data), loaded by `engine.attribution.scm.builtin_models`."""
