"""Offloaded inference: a whole module within a device budget (:mod:`.module`), its plan
(:mod:`.plan`) and groups (:mod:`.groups`), where its bytes come from (:mod:`.sources`), the pinned
transport that streams them (:mod:`.transport`), checkpoints (:mod:`.load`) and the disk tier
(:mod:`.disk`, :mod:`.kvikio`)."""
