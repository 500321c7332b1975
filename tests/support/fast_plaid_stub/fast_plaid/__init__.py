"""A stand-in for fast-plaid (``tests/support/fast_plaid_files.py`` says why): its
``search.FastPlaid`` interface, as PyLate 1.6's ``indexes.PLAID`` uses it, over the
index writer and the float64 search of ``fast_plaid_files``."""
