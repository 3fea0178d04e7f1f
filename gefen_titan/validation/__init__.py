"""Reshard validation: prove on your own cluster that a resume at another size is exact."""
