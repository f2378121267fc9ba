"""Rank primitives: where a rank sits (`world`), FSDP2 sharding and sharded checkpoints
(`sharding`), splitting samples across ranks (`split`). They import no other part of Rollover,
so the parts that train (`training/`) and serve (`engine/`) build on them; running a whole run
on several ranks (rank 0 drives, the others follow) is `rollover.ranks`, above both."""
