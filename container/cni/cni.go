package cni

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/shuntnet/shunt/hostd/admin"
)

// Versions are the CNI spec versions the plugin speaks: those with a
// prevResult, since it only ever runs chained.
var Versions = version.PluginSupports("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")

// Error codes of its own (the spec leaves 100 and up to plugins), and
// the spec's for STATUS.
const (
	ErrRefused     uint = 100 // hostd refused the guest; the message says why
	ErrUnavailable uint = 50  // STATUS: the plugin cannot serve an ADD now (hostd not answering)
)

// Conf is the plugin's network configuration:
//
//	{"type": "shunt", "group": "default", "admin_socket": "/run/shunt/admin.sock", "interface": "auto"}
type Conf struct {
	types.PluginConf
	Group       string `json:"group"`                  // the trust group in hostd.hcl (default "default")
	AdminSocket string `json:"admin_socket,omitempty"` // default /run/shunt/admin.sock
	// Interface: "auto" (default) marks the container's connections by
	// the host end of its veth when that end is routed (ptp), not a
	// bridge port; "none" never does (the guest's claims then rest on
	// its addresses and its namespace).
	Interface string `json:"interface,omitempty"`
}

// Plugin runs the commands. HostPeer finds the host end of the
// container's interface; tests replace it.
type Plugin struct {
	HostPeer func(netns, ifname string) (name string, bridged bool, err error)
}

// GuestName is the guest hostd knows a container by: "cni-" and its
// container id (cut to fit hostd's 64 bytes), or an error for an id hostd
// could not take as a name.
func GuestName(containerID string) (string, error) {
	if containerID == "" {
		return "", types.NewError(types.ErrInvalidEnvironmentVariables, "CNI_CONTAINERID is empty", "")
	}
	for _, c := range containerID {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '.' || c == '-') {
			return "", types.NewError(types.ErrInvalidEnvironmentVariables, fmt.Sprintf("CNI_CONTAINERID %q: shunt takes only A-Z a-z 0-9 _ . -", containerID), "")
		}
	}
	return "cni-" + containerID[:min(len(containerID), 60)], nil
}

func parse(stdin []byte) (*Conf, error) {
	c := &Conf{}
	if err := json.Unmarshal(stdin, c); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "shunt: cannot parse the network configuration", err.Error())
	}
	if err := version.ParsePrevResult(&c.PluginConf); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "shunt: cannot parse prevResult", err.Error())
	}
	if c.Group == "" {
		c.Group = "default"
	}
	if c.AdminSocket == "" {
		c.AdminSocket = "/run/shunt/admin.sock"
	}
	switch c.Interface {
	case "":
		c.Interface = "auto"
	case "auto", "none":
	default:
		return nil, types.NewError(types.ErrInvalidNetworkConfig, fmt.Sprintf("shunt: interface %q: want \"auto\" or \"none\"", c.Interface), "")
	}
	return c, nil
}

// Spec is the guest an ADD registers: the container's namespace, the
// addresses the previous plugin gave its interface args.IfName, and the
// host end of that interface when hostd can mark by it.
func (p *Plugin) Spec(args *skel.CmdArgs, c *Conf) (admin.GuestSpec, *current.Result, error) {
	name, err := GuestName(args.ContainerID)
	if err != nil {
		return admin.GuestSpec{}, nil, err
	}
	if args.Netns == "" {
		return admin.GuestSpec{}, nil, types.NewError(types.ErrInvalidNetNS, "shunt: CNI_NETNS is empty", "")
	}
	if c.PrevResult == nil {
		return admin.GuestSpec{}, nil, types.NewError(types.ErrInvalidNetworkConfig,
			"shunt must be chained after the plugin that makes the container's interface (bridge, ptp, ...): no prevResult", "")
	}
	res, err := current.NewResultFromResult(c.PrevResult)
	if err != nil {
		return admin.GuestSpec{}, nil, types.NewError(types.ErrDecodingFailure, "shunt: cannot convert prevResult", err.Error())
	}
	spec := admin.GuestSpec{Name: name, Group: c.Group, Netns: args.Netns, Container: args.ContainerID}
	spec.Addresses = Addresses(res, args.IfName)
	if len(spec.Addresses) == 0 {
		return admin.GuestSpec{}, nil, types.NewError(types.ErrInvalidNetworkConfig,
			fmt.Sprintf("shunt: the previous plugin's result gives interface %s no address", args.IfName), "")
	}
	if c.Interface == "auto" && p.HostPeer != nil {
		peer, bridged, err := p.HostPeer(args.Netns, args.IfName)
		if err != nil {
			return admin.GuestSpec{}, nil, types.NewError(types.ErrInternal, "shunt: cannot find the host end of "+args.IfName, err.Error())
		}
		if !bridged {
			spec.Interface = peer
		}
	}
	return spec, res, nil
}

// Addresses are the addresses res gives the container's interface
// ifname; with no interface named in res, all its addresses.
func Addresses(res *current.Result, ifname string) []string {
	var out []string
	for _, ip := range res.IPs {
		if ip.Interface != nil {
			i := *ip.Interface
			if i < 0 || i >= len(res.Interfaces) || res.Interfaces[i].Name != ifname || res.Interfaces[i].Sandbox == "" {
				continue
			}
		}
		a := ip.Address.IP.String()
		if !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	return out
}

// Add registers the container as a guest and passes the previous result on.
func (p *Plugin) Add(args *skel.CmdArgs) error {
	c, err := parse(args.StdinData)
	if err != nil {
		return err
	}
	spec, res, err := p.Spec(args, c)
	if err != nil {
		return err
	}
	var rep admin.GuestReply
	if err := call(c.AdminSocket, admin.Request{Cmd: admin.CmdGuestAdd, Spec: &spec}, &rep); err != nil {
		return err
	}
	return types.PrintResult(res, c.CNIVersion)
}

// Del removes the container's guest. A guest hostd does not have is no
// error (a repeated DEL, a DEL after hostd dropped it); nor is hostd not
// answering: then it drops the guest itself once its namespace is gone
// (docs/containers.md), and failing the DEL would only keep the runtime
// from freeing the rest.
func (p *Plugin) Del(args *skel.CmdArgs) error {
	c, err := parse(args.StdinData)
	if err != nil {
		return err
	}
	name, err := GuestName(args.ContainerID)
	if err != nil {
		return err
	}
	var rep admin.GuestReply
	err = call(c.AdminSocket, admin.Request{Cmd: admin.CmdGuestRemove, Guest: name}, &rep)
	var unreachable *unreachableError
	if errors.As(err, &unreachable) {
		return nil
	}
	return err
}

// Check reports an error unless hostd has the container's guest, with
// the namespace and addresses an ADD would give it now.
func (p *Plugin) Check(args *skel.CmdArgs) error {
	c, err := parse(args.StdinData)
	if err != nil {
		return err
	}
	spec, _, err := p.Spec(args, c)
	if err != nil {
		return err
	}
	var specs []admin.GuestSpec
	if err := call(c.AdminSocket, admin.Request{Cmd: admin.CmdGuestList}, &specs); err != nil {
		return err
	}
	for _, s := range specs {
		if s.Name != spec.Name {
			continue
		}
		if s.Netns != spec.Netns || s.Group != spec.Group || !slices.Equal(s.Addresses, spec.Addresses) || s.Interface != spec.Interface {
			return types.NewError(ErrRefused, fmt.Sprintf("shunt: hostd's guest %s differs from the container (netns %s, group %s, addresses %s, interface %q)",
				s.Name, s.Netns, s.Group, strings.Join(s.Addresses, ","), s.Interface), "")
		}
		return nil
	}
	return types.NewError(types.ErrUnknownContainer, fmt.Sprintf("shunt: hostd has no guest %s for this container", spec.Name), "")
}

// Status (CNI 1.1) fails with code 50 while hostd does not answer, when
// an ADD could not register a container. GC is left to hostd, which drops
// the guests whose namespace went (the plugin has none of its own state).
func (p *Plugin) Status(args *skel.CmdArgs) error {
	c, err := parse(args.StdinData)
	if err != nil {
		return err
	}
	if err := admin.Call(c.AdminSocket, admin.Request{Cmd: admin.CmdStatus}, nil); err != nil {
		return types.NewError(ErrUnavailable, "shunt: hostd is not answering at "+c.AdminSocket, err.Error())
	}
	return nil
}

type unreachableError struct{ err error }

func (e *unreachableError) Error() string { return e.err.Error() }
func (e *unreachableError) Unwrap() error { return e.err }

// call sends req to hostd: an unreachable hostd is "try again later" (11),
// a refusal ErrRefused with hostd's reason.
func call(sock string, req admin.Request, out any) error {
	err := admin.Call(sock, req, out)
	var op *net.OpError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &op) && op.Op == "dial":
		return &unreachableError{types.NewError(types.ErrTryAgainLater, "shunt: hostd is not answering at "+sock, err.Error())}
	}
	return types.NewError(ErrRefused, "shunt: hostd: "+err.Error(), "")
}
