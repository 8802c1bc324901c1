"""python -m tiermem {info,demo}"""
import sys

from ._cli import main

sys.exit(main())
