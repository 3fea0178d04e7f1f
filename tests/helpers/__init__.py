"""Workers, harnesses and shared set-up of the tests (imported as ``tests.helpers.*``)."""
