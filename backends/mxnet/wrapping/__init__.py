"""Converting a Gluon net for a policy: the Trainer's refusals, parameter and boundary casts,
float32 islands (in ``F`` and in imported ``SymbolBlock`` graphs), float32 masters and the
initial broadcast, one Trainer per net, and ``net.export``."""
