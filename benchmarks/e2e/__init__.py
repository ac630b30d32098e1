"""The end-to-end benchmark: peers, workload, load generator, runner and plot."""
