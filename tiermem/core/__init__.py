"""The core: the engine (:mod:`.engine`) and its tiered tensor, transfers, statistics, budget
leases and report, and the one streaming primitive every mover shares (:mod:`.stream`)."""
