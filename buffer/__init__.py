"""The replay buffer: Redis Streams carrying prompts to rollout servers and trajectories to the learner."""
