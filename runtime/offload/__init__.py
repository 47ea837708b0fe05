"""The offload room: the memory plan, the expert store (slow tier), the expert cache (fast tier), the host tier."""
