"""What a process of the run sets up for itself, below every other layer (torch and the standard library only).

heap.py          start-up imports without the garbage collector, and their objects frozen after
distributed.py   the default process group of a trainer rank, for either backend
bound_store.py   torch's TCPStore, its server listening on the one address its clients use
"""
