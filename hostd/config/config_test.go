package config_test

import (
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/config"
)

const good = `
log_level = "debug"
log_format = "json"
admin_socket = "/run/shunt/admin.sock"
pairing_timeout = "500ms"

trust_group "tenant" {
  region_size = "16MiB"
  slots       = 64
}

guest "a" {
  id        = 1
  group     = "tenant"
  control   = "/run/shunt/a.sock"
  addresses = ["10.77.1.2"]
}

guest "b" {
  id        = 2
  group     = "tenant"
  control   = "/run/shunt/b.sock"
  addresses = ["10.77.2.2", "fd00::2"]
  ct_mark   = 2
}

policy {
  default   = "fastpath"
  ring_size = "256KiB"
  rule "no-ssh" {
    action = "tcp"
    ports  = ["22"]
  }
}
`

func TestParseGood(t *testing.T) {
	c, err := config.Parse("hostd.hcl", []byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if c.LogLevel != "debug" || c.LogFormat != "json" || c.PairingTimeout != 500*time.Millisecond || c.ReattachGrace != 5*time.Second {
		t.Fatalf("top level: %+v", c)
	}
	if len(c.Groups) != 1 || c.Groups[0].Region != "/dev/shm/shunt-tenant" || c.Groups[0].Geometry.Size != 16<<20 || c.Groups[0].Geometry.Slots != 64 {
		t.Fatalf("groups: %+v", c.Groups)
	}
	if len(c.Guests) != 2 || c.Guests[1].CTMark != 2 || len(c.Guests[1].Addresses) != 2 {
		t.Fatalf("guests: %+v", c.Guests)
	}
	if len(c.Policy.Rules) != 1 || c.Policy.Rules[0].Line != 30 {
		t.Fatalf("policy: %+v", c.Policy)
	}
	if c.Libvirt != nil {
		t.Fatalf("libvirt on without a libvirt block: %+v", c.Libvirt)
	}
}

func TestParseLibvirt(t *testing.T) {
	c, err := config.Parse("hostd.hcl", []byte(good+"libvirt {}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Libvirt == nil || c.Libvirt.Socket != "/run/libvirt/libvirt-sock" || c.Libvirt.URI != "qemu:///system" {
		t.Fatalf("defaults: %+v", c.Libvirt)
	}
	c, err = config.Parse("hostd.hcl", []byte(good+"libvirt {\n  socket = \"/tmp/lv/sock\"\n  uri = \"qemu:///session\"\n}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Libvirt.Socket != "/tmp/lv/sock" || c.Libvirt.URI != "qemu:///session" {
		t.Fatalf("set: %+v", c.Libvirt)
	}
}

func TestParseErrorsNameFileAndLine(t *testing.T) {
	tests := []struct {
		name, src, want string
	}{
		{"typo in attribute", strings.Replace(good, "pairing_timeout", "pairing_timout", 1), `hostd.hcl:5,1: Unsupported argument`},
		{"syntax", good + "\nguest {", "hostd.hcl:"},
		{"unknown group", strings.Replace(good, `group     = "tenant"`, `group     = "tenat"`, 1), `guest "a" (line 12): trust group "tenat" is not defined`},
		{"duplicate id", strings.Replace(good, "id        = 2", "id        = 1", 1), `id 1 is already guest "a"'s`},
		{"bad address", strings.Replace(good, `"10.77.1.2"`, `"10.77.1"`, 1), `address "10.77.1"`},
		{"bad region size", strings.Replace(good, `"16MiB"`, `"16 parsecs"`, 1), `trust_group "tenant" (line 7): region_size`},
		{"bad policy", strings.Replace(good, `ports  = ["22"]`, `ports  = ["ssh"]`, 1), `rule "no-ssh" (line 30): ports: "ssh"`},
		{"bad log level", strings.Replace(good, `"debug"`, `"verbose"`, 1), `log_level "verbose"`},
		{"bad log format", strings.Replace(good, `"json"`, `"yaml"`, 1), `log_format "yaml"`},
		{"bad duration", strings.Replace(good, `"500ms"`, `"soon"`, 1), "pairing_timeout"},
		{"relative libvirt socket", good + "libvirt {\n  socket = \"libvirt-sock\"\n}\n", `libvirt socket "libvirt-sock": want an absolute path`},
		{"libvirt typo", good + "libvirt {\n  sokcet = \"/run/x\"\n}\n", `Unsupported argument`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := config.Parse("hostd.hcl", []byte(tt.src))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error = %v; want one containing %q", err, tt.want)
			}
		})
	}
}

func TestParseLimits(t *testing.T) {
	c, err := config.Parse("hostd.hcl", []byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if c.Limits != config.DefaultLimits {
		t.Fatalf("limits without a block: %+v, want the defaults %+v", c.Limits, config.DefaultLimits)
	}
	c, err = config.Parse("hostd.hcl", []byte(good+"limits {\n  sessions_per_guest = 8\n  intents_per_guest = 16\n  keepalive = \"1s\"\n  silence = \"3s\"\n}\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := config.DefaultLimits
	want.SessionsPerGuest, want.Keepalive, want.Silence = 8, time.Second, 3*time.Second // intents_per_guest: accepted, ignored
	if c.Limits != want {
		t.Fatalf("limits %+v, want %+v", c.Limits, want)
	}
	for _, tt := range []struct{ name, block, want string }{
		{"zero", "listens_per_guest = 0", "listens_per_guest 0: want 1 to"},
		{"silence too short", "keepalive = \"2s\"\n  silence = \"3s\"", "less than twice keepalive"},
		{"bad duration", "silence = \"long\"", "limits: silence"},
		{"typo", "session_per_guest = 3", "Unsupported argument"},
		{"fewer sessions than ports", "sessions_per_guest = 2", "control_ports 3 is more than limits.sessions_per_guest 2"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			src := strings.Replace(good, `addresses = ["10.77.1.2"]`, "addresses = [\"10.77.1.2\"]\n  control_ports = 3", 1)
			_, err := config.Parse("hostd.hcl", []byte(src+"limits {\n  "+tt.block+"\n}\n"))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error = %v; want one containing %q", err, tt.want)
			}
		})
	}
}

func TestParseMetricsAddress(t *testing.T) {
	c, err := config.Parse("hostd.hcl", []byte("metrics_address = \"unix:/run/shunt/metrics.sock\"\n"+good))
	if err != nil {
		t.Fatal(err)
	}
	if got := config.MetricsUnix(c.MetricsAddress); got != "/run/shunt/metrics.sock" {
		t.Fatalf("MetricsUnix(%q) = %q, want /run/shunt/metrics.sock", c.MetricsAddress, got)
	}
	if _, err := config.Parse("hostd.hcl", []byte("metrics_address = \"unix:metrics.sock\"\n"+good)); err == nil || !strings.Contains(err.Error(), "absolute path") {
		t.Fatalf("relative unix path: error %v, want one asking for an absolute path", err)
	}
}

// TestParseOwnership: hostd marks connections unless told otherwise; the
// old witness switch still works, as "both"; ct_mark_mask is a contiguous
// run of bits; a ct_mark that uses hostd's bits is refused with what to do.
func TestParseOwnership(t *testing.T) {
	for _, tt := range []struct {
		name, top      string
		ownership      string
		witness, marks bool
		mask           uint32
	}{
		{"default", "", config.OwnershipMark, false, true, 0xffff0000},
		{"addresses", `ownership = "addresses"`, config.OwnershipAddresses, false, false, 0xffff0000},
		{"witness", `ownership = "witness"`, config.OwnershipWitness, true, false, 0xffff0000},
		{"both", `ownership = "both"`, config.OwnershipBoth, true, true, 0xffff0000},
		{"old witness switch", `witness = true`, config.OwnershipBoth, true, true, 0xffff0000},
		{"mask", `ct_mark_mask = "0x00ff0000"`, config.OwnershipMark, false, true, 0x00ff0000},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c, err := config.Parse("hostd.hcl", []byte(tt.top+"\n"+good))
			if err != nil {
				t.Fatal(err)
			}
			if c.Ownership != tt.ownership || c.Witness != tt.witness || c.Marks() != tt.marks || c.CTMarkMask != tt.mask {
				t.Fatalf("ownership %q witness %v marks %v mask %#x; want %q %v %v %#x", c.Ownership, c.Witness, c.Marks(), c.CTMarkMask, tt.ownership, tt.witness, tt.marks, tt.mask)
			}
		})
	}
	for _, tt := range []struct{ name, src, want string }{
		{"unknown", `ownership = "mac"` + "\n" + good, `ownership "mac": want "mark"`},
		{"both spellings", "ownership = \"mark\"\nwitness = true\n" + good, `witness = true is the old spelling of ownership = "both": give ownership only`},
		{"mask of one bit", `ct_mark_mask = "0x80000000"` + "\n" + good, "ct_mark_mask: ct mark mask 0x80000000: want at least 4 bits"},
		{"mask in two runs", `ct_mark_mask = "0xff00ff00"` + "\n" + good, "want one run of adjacent bits"},
		{"mask not a number", `ct_mark_mask = "high"` + "\n" + good, `ct_mark_mask: "high"`},
		{"ct_mark in hostd's bits", strings.Replace(good, "ct_mark   = 2", "ct_mark   = 131072", 1),
			`guest "b" (line 19): ct_mark 0x20000 uses bits of ct_mark_mask 0xffff0000, which hostd now sets itself`},
		{"ct_mark too big", strings.Replace(good, "ct_mark   = 2", "ct_mark   = 4294967296", 1), "ct_mark 4294967296: want 0 to 4294967295"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := config.Parse("hostd.hcl", []byte(tt.src))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error = %v; want one containing %q", err, tt.want)
			}
		})
	}
	// Without hostd's marks, a ct_mark may use any bits, as before.
	src := "ownership = \"addresses\"\n" + strings.Replace(good, "ct_mark   = 2", "ct_mark   = 131072", 1)
	if c, err := config.Parse("hostd.hcl", []byte(src)); err != nil || c.Guests[1].CTMark != 131072 {
		t.Fatalf("ct_mark in the high bits without marks: %v", err)
	}
}

// TestParseRefusesSharedOwnership: two guests cannot own one address or
// share one interface; the error names both guests and the address.
func TestParseRefusesSharedOwnership(t *testing.T) {
	for _, tt := range []struct{ name, src, want string }{
		{"same address", strings.Replace(good, `addresses = ["10.77.2.2", "fd00::2"]`, `addresses = ["10.77.2.2", "10.77.1.2"]`, 1),
			`guest "b" (line 19): address 10.77.1.2 is already guest "a"'s: two guests cannot own one address`},
		{"same address, IPv4-mapped", strings.Replace(good, `addresses = ["10.77.2.2", "fd00::2"]`, `addresses = ["::ffff:10.77.1.2"]`, 1),
			`address 10.77.1.2 is already guest "a"'s`},
		{"same interface", strings.Replace(strings.Replace(good, `addresses = ["10.77.1.2"]`, `interface = "vnet0"`, 1), `addresses = ["10.77.2.2", "fd00::2"]`, `interface = "vnet0"`, 1),
			`guest "b" (line 19): interface vnet0 is already guest "a"'s`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := config.Parse("hostd.hcl", []byte(tt.src))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error = %v; want one containing %q", err, tt.want)
			}
		})
	}
	// One guest may name an address twice.
	src := strings.Replace(good, `addresses = ["10.77.1.2"]`, `addresses = ["10.77.1.2", "10.77.1.2"]`, 1)
	if _, err := config.Parse("hostd.hcl", []byte(src)); err != nil {
		t.Fatal(err)
	}
}

// TestParseSwitching: the ruleset watch is on unless turned off, and the
// shutdown grace defaults to 2 s.
func TestParseSwitching(t *testing.T) {
	c, err := config.Parse("hostd.hcl", []byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if !c.WatchRuleset || c.ShutdownGrace != 2*time.Second {
		t.Fatalf("defaults: watch_ruleset %v, shutdown_grace %v; want true, 2s", c.WatchRuleset, c.ShutdownGrace)
	}
	c, err = config.Parse("hostd.hcl", []byte("watch_ruleset = false\nshutdown_grace = \"500ms\"\n"+good))
	if err != nil {
		t.Fatal(err)
	}
	if c.WatchRuleset || c.ShutdownGrace != 500*time.Millisecond {
		t.Fatalf("set: watch_ruleset %v, shutdown_grace %v; want false, 500ms", c.WatchRuleset, c.ShutdownGrace)
	}
	if _, err := config.Parse("hostd.hcl", []byte("shutdown_grace = \"-1s\"\n"+good)); err == nil || !strings.Contains(err.Error(), "shutdown_grace") {
		t.Fatalf("negative shutdown_grace: %v, want an error naming it", err)
	}
}

// TestParseVMRegions: vm_regions = "pair" needs a qmp socket for each VM
// of the group and ivshmem-sized pair regions; qmp elsewhere is refused.
func TestParseVMRegions(t *testing.T) {
	conf := func(group, guest string) string {
		return "trust_group \"t\" {\n" + group + "}\nguest \"vm\" {\n  id = 1\n  group = \"t\"\n  control = \"/run/vm.sock\"\n  addresses = [\"10.0.0.1\"]\n" + guest + "}\npair_region_linger = \"1s\"\n"
	}
	c, err := config.Parse("hostd.hcl", []byte(conf("  vm_regions = \"pair\"\n", "  shared_region = true\n  qmp = \"/run/vm.qmp\"\n")))
	if err != nil {
		t.Fatal(err)
	}
	if c.Groups[0].VMRegions != config.VMRegionsPair || c.Guests[0].QMP != "/run/vm.qmp" || c.PairRegionLinger != time.Second {
		t.Fatalf("group %+v, guest %+v, linger %v", c.Groups[0], c.Guests[0], c.PairRegionLinger)
	}
	if c, err := config.Parse("hostd.hcl", []byte(good)); err != nil || c.Groups[0].VMRegions != config.VMRegionsGroup {
		t.Fatalf("default vm_regions: %v, %v; want group", c.Groups[0].VMRegions, err)
	}
	for _, tc := range []struct{ name, group, guest, want string }{
		{"no qmp", "  vm_regions = \"pair\"\n", "  shared_region = true\n", "give this VM its QEMU's QMP socket"},
		{"qmp without pair", "", "  shared_region = true\n  qmp = \"/run/vm.qmp\"\n", "qmp is for VMs"},
		{"bad value", "  vm_regions = \"pairs\"\n", "", "want \"group\" or \"pair\""},
		{"not a BAR size", "  vm_regions = \"pair\"\n  pair_region_size = \"12MiB\"\n", "", "power of two"},
		{"libvirt pair region's name", "  region = \"/dev/shm/shunt-pair-1-2\"\n", "", "hostd's names for libvirt domains' pair regions"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := config.Parse("hostd.hcl", []byte(conf(tc.group, tc.guest)))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Parse = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
