"""The JABAS loop on a simulated clock (no Ray, no torch)."""
