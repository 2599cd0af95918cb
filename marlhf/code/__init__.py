"""The code task (APPS, paper §4.4 and App. B.5): sandboxed program execution, APPS problems, the
program-test reward."""
