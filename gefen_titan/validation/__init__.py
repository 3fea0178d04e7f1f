"""Reshard validation: prove on your own cluster that a resume at another size is exact.

The command is ``gefen-titan validate`` (``command.py``); docs/validation.md
says what each module here does and what is checked.
"""
