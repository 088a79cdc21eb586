"""The elastic cell scheduler: `policy` decides (pure), cells and the service apply the decisions."""
