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
# shutdown_grace = "2s"   # a stopping hostd moves connections to TCP and waits this long for the guests
# watch_ruleset  = true   # a firewall ruleset change moves connections to TCP until their lease carries packets both ways

# vsockd_socket = "/run/shunt/vsockd.sock"  # shunt-vsockd serves the QEMU VMs' vsock devices, so a hostd restart keeps them (systemctl enable --now shunt-vsockd; docs/vsock.md)
# state_dir  = "/run/shunt/state"     # root-only: hostd's record of every region
# region_dir = "/run/shunt/regions"   # root-only: the regions of process-guest pairs
# Containers (docs/containers.md): the socket the CDI device shunt.net/guest
# mounts (its directory, whole) and the CNI plugin's guests use.
# container_socket = "/run/shunt/container/control.sock"

trust_group "tenant-a" {
  region      = "/dev/shm/shunt-tenant-a"   # the VMs' region (shared_region guests)
  region_size = "64MiB"
  slots       = 256
  # region_group = "kvm"   # when libvirt runs QEMU as libvirt-qemu:kvm
  # hostd check says how many concurrent fast-path connections each guest
  # may hold; a group of process guests gets room for 32 by default:
  # pair_region_size = "128MiB"  # each pair of process guests gets its own
  # guest_ring_bytes = "16MiB"   # per guest: rings of the flows it opens (default region_size/4; process guests: 32 flows at least)
  # guest_flows      = 64        # per guest: flows it opens (default slots/4; process guests: 32 at least)
  # vm_regions = "pair"   # a region per VM pair, hot-plugged into both VMs (each
  #                       # VM needs qmp = "/run/shunt/vm1.qmp", a libvirt domain no
  #                       # <shmem> and <shunt:group>; docs/vm.md, "Pair regions")
}

# Register running libvirt domains that carry Shunt's devices and metadata
# as guests (docs/vm.md, "libvirt"); their channel sockets belong under
# /run/shunt, which the systemd unit lets hostd write.
# libvirt {
#   socket = "/run/libvirt/libvirt-sock"
#   uri    = "qemu:///system"
# }

# Peer hosts' hostds (docs/crosshost.md: what of the cross-host path is
# built): mutual TLS with a CA of the fleet; each peer may announce only
# its prefixes. Connections to a peer's guests stay on TCP today
# (peer-unreachable while its channel is down).
# peering {
#   listen      = "192.0.2.1:7470"
#   certificate = "/etc/shunt/peer.pem"
#   key         = "/etc/shunt/peer.key"
#   ca          = "/etc/shunt/peer-ca.pem"
# }
# peer "host-b" {
#   address  = "192.0.2.2:7470"
#   prefixes = ["10.78.0.0/16"]
# }

guest "vm1" {
  id        = 1
  group     = "tenant-a"
  control   = "/run/shunt/vm1.sock"
  interface = "vnet0"      # its addresses: the routes on its tap; hostd marks its connections by it
  shared_region = true     # a VM: maps the group's region (its ivshmem BAR)
}

guest "vm2" {
  id        = 2
  group     = "tenant-a"
  control   = "/run/shunt/vm2.sock"
  addresses = ["192.168.100.12"]
  shared_region = true
  # A VM without ivshmem: hostd (or shunt-vsockd, with vsockd_socket)
  # serves its vhost-user-vsock device and carries its flows over vsock
  # (docs/vsock.md). QEMU: -chardev socket,id=vs,path=...
  # -device vhost-user-vsock-pci,chardev=vs, with shared guest memory.
  # vsock {
  #   socket = "/run/shunt/vm2.vsock"
  #   cid    = 4
  # }
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

# What one guest may hold of hostd's control plane (docs/config.md,
# "limits"); the defaults suit an MPI job's wire-up from one busy guest.
limits {
  sessions_per_guest = 256
  keepalive          = "2s"
  silence            = "10s"
}
