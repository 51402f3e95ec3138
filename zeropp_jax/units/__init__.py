"""The unit transform (gather, remat, regather, reduce), unit ordering, wrap policies and weight paths."""
