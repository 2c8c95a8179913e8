# Example hostd configuration; docs/config.md is the reference. The
# shunt-host package installs it as /etc/shunt/hostd.hcl. What belongs to
# this example host and must be edited: the guests (their control sockets,
# and the interface or addresses that say which traffic is theirs), the
# trust group's region, and the policy's CIDRs. The package test
# (packaging/deb_test.go) runs the installed hostd with this file, changing
# only the guests' control, interface and addresses, the region, and, to
# stay clear of a real hostd, admin_socket, metrics_address and
# conntrack_netns.
log_level       = "info"   # trace, debug, info, warn, error
log_format      = "json"   # or "text"
admin_socket    = "/run/shunt/admin.sock"
metrics_address = "127.0.0.1:9469"
pairing_timeout = "2s"
reattach_grace  = "5s"

trust_group "tenant-a" {
  region      = "/dev/shm/shunt-tenant-a"
  region_size = "64MiB"
  slots       = 256
  # region_group = "kvm"   # when libvirt runs QEMU as libvirt-qemu:kvm
}

# Register running libvirt domains that carry Shunt's devices and metadata
# as guests (docs/vm.md, "libvirt"); their channel sockets belong under
# /run/shunt, which the systemd unit lets hostd write.
# libvirt {
#   socket = "/run/libvirt/libvirt-sock"
#   uri    = "qemu:///system"
# }

guest "vm1" {
  id        = 1
  group     = "tenant-a"
  control   = "/run/shunt/vm1.sock"
  interface = "vnet0"      # learn the guest's addresses from the routes on its tap
  ct_mark   = 1            # nft: ct state new iifname "vnet0" ct mark set 1
}

guest "vm2" {
  id        = 2
  group     = "tenant-a"
  control   = "/run/shunt/vm2.sock"
  addresses = ["192.168.100.12"]
}

policy {
  default             = "fastpath"
  ring_size           = "1MiB"
  max_flows_per_guest = 256

  rule "ssh-stays-on-tcp" {
    action = "tcp"
    ports  = ["22"]
  }

  rule "mpi" {
    action    = "fastpath"
    from      = ["192.168.100.0/24"]
    to        = ["192.168.100.0/24"]
    ports     = ["1024-65535"]
    ring_size = "4MiB"
  }
}
