"""Graph-import front ends: other frameworks' graphs as FX graphs for the rec_ascend pipeline."""
