"""``python -m gefen_titan ckpt|validate ...``: the ``gefen-titan`` command without the console script."""

import sys

from gefen_titan.cli import main

# Guarded: `validate --launcher fork` starts ranks from a multiprocessing fork
# server, whose children import this module as __mp_main__.
if __name__ == "__main__":
    sys.exit(main())
