"""The Kubernetes mutating admission webhook (not built yet): a pod annotation injects the agent
and the sidecar. Never imports torch.
"""
