"""python -m tiermem {info,demo}"""
import sys

from .cli.main import main

sys.exit(main())
