"""Plain helpers shared by test modules: builders, constants, small servers. Never tests, never fixtures.

Fixtures live in ``tests/conftest.py`` (pytest finds them there); a test module imports helpers from
here and never from another test module or from ``tests.conftest`` (``tests/test_test_layout.py``).
"""
