# hostd configuration for the Vagrant rig (on the host running libvirt).
log_level = "info"
admin_socket = "/run/shunt/admin.sock"

trust_group "tenant" {
  region      = "/dev/shm/shunt-tenant"
  region_size = "64MiB"
  slots       = 256
}

guest "g1" {
  id        = 1
  group     = "tenant"
  control   = "/run/shunt/g1.sock"   # and g1.sock.1: two ports
  control_ports = 2
  addresses = ["192.168.121.11"]
}

guest "g2" {
  id        = 2
  group     = "tenant"
  control   = "/run/shunt/g2.sock"
  control_ports = 2
  addresses = ["192.168.121.12"]
}
