"""Training within a device budget: the handle (:mod:`.handle`), its plan from a traced step
(:mod:`.plan`) and the choice between plans (:mod:`.choice`, :mod:`.graphchoice`), the blocks'
slots and optimizer states (:mod:`.slots`, :mod:`.states`), activations swapped or recomputed
(:mod:`.swap`, :mod:`.recompute`, :mod:`.replay`), clipping, and whole-step graphs
(:mod:`.stepgraph`)."""
