"""The base layer: dtypes, sizes and limits, the default tier's slot, fast-resident host pages.

Imports nothing else of tiermem's but :mod:`tiermem.errors` and :mod:`tiermem.roles`, which sit on
this layer too (they are public, so they stand at the package's top).
"""
