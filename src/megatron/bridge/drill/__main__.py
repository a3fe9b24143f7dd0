"""``python -m megatron.bridge.drill``: see :mod:`megatron.bridge.drill.cli`."""

import sys

from megatron.bridge.drill.cli import main

sys.exit(main())
