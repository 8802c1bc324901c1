"""``python -m tiermem``: info, demo (:mod:`.demo`) and plan (:mod:`.plan`)."""
