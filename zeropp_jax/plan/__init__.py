"""Planning: a cost model of a step's time and memory, and the automatic configuration.

``cost_model`` is the arithmetic (hardware constants x a step's collectives, flops and
memory); ``workload`` lists a configuration's collectives for a model; ``measured`` reads
a train state's activations from a compiled step of it; ``auto`` ranks the configurations
and picks one (``zpp.auto_config``).
"""
