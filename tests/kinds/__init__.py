"""Optimizer kinds defined by the tests, each a folder laid out as a built-in kind's (``optim/kinds/<kind>/``)."""
