package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/shuntnet/shunt/container/cdi"
	"github.com/shuntnet/shunt/hostd/admin"
	"github.com/shuntnet/shunt/hostd/config"
)

const guestUsage = `usage:
  hostd guest add -name NAME -group GROUP -netns PATH [-interface IF] [-addr A,B] [-control PATH] [-id N] [-container ID]
  hostd guest remove NAME
  hostd guest list
flags: -admin SOCKET (default /run/shunt/admin.sock), -json`

// runGuest is `hostd guest add|remove|list`: guests at run time
// (docs/containers.md).
func runGuest(args []string) error {
	if len(args) < 1 {
		return fmt.Errorf("%s", guestUsage)
	}
	sub, args := args[0], args[1:]
	fs := flag.NewFlagSet("guest "+sub, flag.ExitOnError)
	sock := fs.String("admin", "/run/shunt/admin.sock", "hostd admin socket")
	asJSON := fs.Bool("json", false, "print JSON")
	var spec admin.GuestSpec
	var addrs string
	var id uint
	if sub == "add" {
		fs.StringVar(&spec.Name, "name", "", "the guest's name (unique among all guests)")
		fs.StringVar(&spec.Group, "group", "", "its trust group (defined in hostd.hcl)")
		fs.StringVar(&spec.Netns, "netns", "", "its network namespace: /run/netns/NAME or /proc/PID/ns/net")
		fs.StringVar(&spec.Interface, "interface", "", "its host-side interface (a veth's host end), by which hostd marks its connections")
		fs.StringVar(&addrs, "addr", "", "the addresses it owns, comma-separated (default: learned from -interface's routes)")
		fs.StringVar(&spec.Control, "control", "", "a control socket of its own at this path (default: hostd's container_socket)")
		fs.StringVar(&spec.Container, "container", "", "the runtime's name for it, shown by list")
		fs.UintVar(&id, "id", 0, "its id (default: hostd picks a free one)")
	}
	fs.Parse(args)
	var req admin.Request
	switch sub {
	case "add":
		if fs.NArg() != 0 || spec.Name == "" || spec.Group == "" || spec.Netns == "" {
			return fmt.Errorf("%s", guestUsage)
		}
		if addrs != "" {
			spec.Addresses = strings.Split(addrs, ",")
		}
		spec.ID = uint32(id)
		req = admin.Request{Cmd: admin.CmdGuestAdd, Spec: &spec}
	case "remove":
		if fs.NArg() != 1 {
			return fmt.Errorf("%s", guestUsage)
		}
		req = admin.Request{Cmd: admin.CmdGuestRemove, Guest: fs.Arg(0)}
	case "list":
		if fs.NArg() != 0 {
			return fmt.Errorf("%s", guestUsage)
		}
		req = admin.Request{Cmd: admin.CmdGuestList}
	default:
		return fmt.Errorf("unknown subcommand %q\n%s", sub, guestUsage)
	}
	var out json.RawMessage
	if err := admin.Call(*sock, req, &out); err != nil {
		return err
	}
	if *asJSON {
		fmt.Println(string(out))
		return nil
	}
	if sub == "list" {
		var specs []admin.GuestSpec
		if err := json.Unmarshal(out, &specs); err != nil {
			return err
		}
		tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
		defer tw.Flush()
		fmt.Fprintln(tw, "GUEST\tID\tGROUP\tNETNS\tINTERFACE\tADDRESSES\tCONTROL\tCONTAINER")
		for _, s := range specs {
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\n", s.Name, s.ID, s.Group, s.Netns, or(s.Interface, "-"), or(strings.Join(s.Addresses, ","), "-"), or(s.Control, "-"), or(s.Container, "-"))
		}
		return nil
	}
	var rep admin.GuestReply
	if err := json.Unmarshal(out, &rep); err != nil {
		return err
	}
	switch {
	case sub == "add" && rep.Added:
		fmt.Printf("guest %s added (id %d)\n", rep.Name, rep.ID)
	case sub == "add":
		fmt.Printf("guest %s was there already with this spec (id %d)\n", rep.Name, rep.ID)
	case rep.Removed:
		fmt.Printf("guest %s removed\n", rep.Name)
	default:
		return fmt.Errorf("no guest %s added at run time (hostd guest list)", rep.Name)
	}
	return nil
}

// runCDI is `hostd cdi`: the CDI spec for this hostd's container_socket
// (docs/containers.md), to write to /etc/cdi/shunt.json or /run/cdi.
func runCDI(args []string) error {
	fs := flag.NewFlagSet("cdi", flag.ExitOnError)
	path := fs.String("config", "/etc/shunt/hostd.hcl", "configuration file")
	lib := fs.String("lib", cdi.DefaultLibrary, "the preload library on this host")
	fs.Parse(args)
	cfg, err := config.Load(*path)
	if err != nil {
		return err
	}
	if cfg.ContainerSocket == "" {
		return fmt.Errorf("%s has no container_socket: set one (such as %s) for containers to reach hostd", *path, cdi.DefaultSocket)
	}
	spec, err := cdi.Make(cfg.ContainerSocket, *lib)
	if err != nil {
		return err
	}
	b, err := spec.JSON()
	if err != nil {
		return err
	}
	_, err = os.Stdout.Write(b)
	return err
}
