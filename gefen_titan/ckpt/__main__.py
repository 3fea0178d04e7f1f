"""``python -m gefen_titan.ckpt inspect|verify|convert ...`` (the same as ``gefen-titan ckpt ...``)."""

import sys

from gefen_titan.ckpt.cli import main

sys.exit(main(prog="python -m gefen_titan.ckpt"))
