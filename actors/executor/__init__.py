"""What runs the workers for the engine loop: in this process or spawned processes (local), or Ray
worker actors in the engine's placement group."""
