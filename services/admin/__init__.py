"""``splitstream``, the admin CLI: experiments, versions and rollouts on the file or Consul registry."""
