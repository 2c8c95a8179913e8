package admin

// Guests at run time (docs/containers.md): `hostd guest add|remove|list`
// and the CNI plugin send these. Only root reaches the admin socket, so
// only root adds guests.
const (
	CmdGuestAdd    = "guest-add"    // add Request.Spec as a guest (GuestReply)
	CmdGuestRemove = "guest-remove" // remove the run-time guest Request.Guest (GuestReply)
	CmdGuestList   = "guest-list"   // the run-time guests ([]GuestSpec)
)

// GuestSpec is a guest added at run time: a process or container guest,
// known by its network namespace. hostd keeps it in its state_dir, so that
// it outlives a restart of hostd as long as its network namespace lives.
type GuestSpec struct {
	Name  string `json:"name"`         // unique among all guests: [A-Za-z0-9_.-], at most 64 bytes
	ID    uint32 `json:"id,omitempty"` // 0: hostd picks a free one
	Group string `json:"group"`        // its trust group, defined in hostd.hcl
	// Netns is a path to its network namespace (/run/netns/NAME,
	// /proc/PID/ns/net): hostd serves it on container_socket to the
	// processes of that namespace only, and a namespace is one guest's.
	Netns string `json:"netns"`
	// Interface is its host-side interface (a veth's host end), by which
	// hostd marks its connections; "" for none (then its claims rest on
	// its addresses and its namespace).
	Interface string   `json:"interface,omitempty"`
	Addresses []string `json:"addresses,omitempty"` // the addresses it owns; none: learned from Interface's routes
	// Control, if set, is a control socket of its own at this path, which
	// takes only processes of its namespace; it reaches hostd through
	// container_socket too (if hostd has one).
	Control string `json:"control,omitempty"`
	// Container is what the runtime calls it (the CNI container id), for
	// people reading `hostd guest list`; hostd does not use it.
	Container string `json:"container,omitempty"`
}

// GuestReply answers CmdGuestAdd and CmdGuestRemove.
type GuestReply struct {
	Name string `json:"name"`
	ID   uint32 `json:"id,omitempty"`
	// Added: a new guest (false: the same spec was there already, an
	// idempotent repeat). Removed: the guest was there and went.
	Added   bool `json:"added,omitempty"`
	Removed bool `json:"removed,omitempty"`
}
