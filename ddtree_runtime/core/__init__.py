"""The round and its contract: the tree, its types and kernels, the TP head, the hidden-state
contract. Imports nothing of ours outside itself."""
