"""A fingerprint of the bytes gefen-titan writes, one hash per kind of checkpoint (tools/format_fingerprint.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.format_fingerprint import main

if __name__ == "__main__":
    main()
