"""How bytes move: flat unit layouts, placement on the mesh, collectives, hpZ two-hop gathers, qgZ, stored-quantized frozen weights."""
