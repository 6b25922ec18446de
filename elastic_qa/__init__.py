"""elastic_qa: an elastic, fault-tolerant data-parallel trainer for extractive question answering."""

__version__ = "0.1.0"
