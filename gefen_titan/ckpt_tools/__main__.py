"""``python -m gefen_titan.ckpt_tools inspect|verify|convert|export ...`` (the same as ``gefen-titan ckpt ...``)."""

import sys

from gefen_titan.ckpt_tools.cli import main

sys.exit(main(prog="python -m gefen_titan.ckpt_tools"))
