"""hsync inside the frameworks people already train with, each an optional extra that `import hsync`
never imports: `hsync.integrations.transformers` (pip install hsync[transformers]),
`hsync.integrations.accelerate` (pip install hsync[accelerate]) and `hsync.integrations.lightning`
(pip install hsync[lightning])."""
