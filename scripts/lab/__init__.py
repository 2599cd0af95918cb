"""Lab equipment of the benchmark scripts, not part of the installed library: the reproduction sweep's variants
and statistics (``sweep``), its run records (``records``), and the report writers (``results_report``,
``cost_report``) of ``scripts/reproduce.py`` and ``scripts/bench_step3.py``.  The scripts import it as ``lab``
(their folder is first on ``sys.path``); the tests put ``scripts/`` on the path in ``conftest.py``."""
