"""The ``isolane`` command line (``isolane.cli.main:main``).

Nothing heavy is imported here or in ``main``: torch and the snapshot machinery load
inside the commands that need them, so ``isolane --help`` stays fast.
"""
