"""Helpers shared by the test folders, imported as ``support.<module>``.

``[tool.pytest.ini_options] pythonpath`` puts ``tests/`` on ``sys.path`` for pytest; scripts
that import these helpers outside pytest (``tests/hosts/*/gpu_parity.py``, the distributed
workers, the subprocesses of the autoactivation tests) get ``tests/`` on ``PYTHONPATH`` from
whatever launches them.  Nothing here may be named like a host library (``pylate``,
``colpali_engine``, ``sentence_transformers``, ``fast_plaid``): this folder's parent is on
``sys.path``, and so is this folder when one of its modules runs as a script.
"""
