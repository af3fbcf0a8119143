import sys

from attn2ssm.cli import main

sys.exit(main())
