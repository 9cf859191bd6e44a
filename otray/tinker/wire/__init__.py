"""The Tinker SDK's formats: its protobuf and JSON messages, sampling parameters and responses, images.

Runs in the gateway's Serve replica and the TinkerService actor, wherever a message is read or written.
"""
