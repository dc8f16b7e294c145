"""Graph passes on the partitioned forward/backward graphs, chosen by name from the registry
(registry): bucketing, overlap, fusion regions, the embedding mask, activation checkpointing,
with the FX and collective tools they share (fx_graph, collectives)."""
