"""The test suite: one folder per package folder (``tests/pyterrier_cpdae/dense/`` tests ``pyterrier_cpdae/dense/``),
``tests/project/`` for the properties of the whole checkout; see docs/development.md, "Test layout"."""
