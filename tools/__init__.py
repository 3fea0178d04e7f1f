"""Developer tools of the checkout (not in the wheel): rebuilding the embedded assets."""
